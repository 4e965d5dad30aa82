package correlator

import "testing"

func ptr[T any](v T) *T { return &v }

// TestClassify covers every row of the reply table (SPEC §6).
func TestClassify(t *testing.T) {
	running := &Target{ID: 7, JobType: "t", JobKey: "k", State: StateRunning, Attempt: 2}
	tests := []struct {
		name        string
		reply       Reply
		target      *Target
		finalExists bool
		want        Verdict
		code        string
	}{
		{"running, id and attempt match", Reply{JobID: ptr[int64](7), JobType: "t", JobKey: "k", Attempt: ptr(2)}, running, false, Apply, ""},
		{"running, id and attempt absent", Reply{JobType: "t", JobKey: "k"}, running, false, Apply, ""},
		{"running, attempt only", Reply{JobType: "t", JobKey: "k", Attempt: ptr(2)}, running, false, Apply, ""},
		{"job already final", Reply{JobType: "t", JobKey: "k"}, &Target{ID: 7, JobType: "t", JobKey: "k", State: StateFinal, Attempt: 2}, false, Duplicate, ""},
		{"job id of a final row", Reply{JobID: ptr[int64](7)}, &Target{ID: 7, JobType: "t", JobKey: "k", State: StateFinal, Attempt: 1}, false, Duplicate, ""},
		{"job id of a pruned row", Reply{JobID: ptr[int64](99), JobType: "t", JobKey: "k"}, nil, false, Stale, ""},
		{"no non-final job, a final one exists", Reply{JobType: "t", JobKey: "k"}, nil, true, Duplicate, ""},
		{"attempt older than the job's", Reply{JobType: "t", JobKey: "k", Attempt: ptr(1)}, running, false, Stale, ""},
		{"attempt already resolved (retry)", Reply{JobType: "t", JobKey: "k", Attempt: ptr(2)}, &Target{ID: 7, JobType: "t", JobKey: "k", State: StateRetry, Attempt: 2}, false, Stale, ""},
		{"retry, attempt absent", Reply{JobType: "t", JobKey: "k"}, &Target{ID: 7, JobType: "t", JobKey: "k", State: StateRetry, Attempt: 2}, false, Stale, ""},
		{"no row at all", Reply{JobType: "t", JobKey: "k"}, nil, false, Early, ""},
		{"initial, attempt absent", Reply{JobType: "t", JobKey: "k"}, &Target{ID: 7, JobType: "t", JobKey: "k", State: StateInitial}, false, Early, ""},
		{"initial, attempt 1", Reply{JobType: "t", JobKey: "k", Attempt: ptr(1)}, &Target{ID: 7, JobType: "t", JobKey: "k", State: StateInitial}, false, Early, ""},
		{"initial, attempt 2", Reply{JobType: "t", JobKey: "k", Attempt: ptr(2)}, &Target{ID: 7, JobType: "t", JobKey: "k", State: StateInitial}, false, DeadLetter, CodeNewerAttempt},
		{"running, newer attempt", Reply{JobType: "t", JobKey: "k", Attempt: ptr(3)}, running, false, DeadLetter, CodeNewerAttempt},
		{"retry, newer attempt", Reply{JobType: "t", JobKey: "k", Attempt: ptr(3)}, &Target{ID: 7, JobType: "t", JobKey: "k", State: StateRetry, Attempt: 2}, false, DeadLetter, CodeNewerAttempt},
		{"job id of another key", Reply{JobID: ptr[int64](7), JobType: "t", JobKey: "other"}, running, false, DeadLetter, CodeMismatch},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Classify(&tt.reply, tt.target, tt.finalExists)
			if got.Verdict != tt.want {
				t.Fatalf("verdict %v, want %v", got.Verdict, tt.want)
			}
			if tt.code != "" && (got.Reason == nil || got.Reason.Code != tt.code) {
				t.Errorf("reason %v, want code %s", got.Reason, tt.code)
			}
		})
	}
}
