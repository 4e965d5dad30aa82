package client

import (
	"encoding/json"
	"fmt"
	"regexp"
)

// OutboxRow is what a transactional enqueue writes into hipq's outbox
// table, hipq_intake: the SQL and its two arguments (the job's intake JSON
// and its headers as a JSON object, or nil). The pgxoutbox and sqloutbox
// packages run it inside an application's transaction; any other driver
// can too.
type OutboxRow struct {
	SQL     string
	Value   string
	Headers *string
}

// OutboxOptions are the choices of a transactional enqueue.
type OutboxOptions struct {
	// Schema is the PostgreSQL schema of hipq's tables (hipq's
	// database.schema); empty means the connection's search_path.
	Schema string
	// Headers travel with the job request, as a Kafka record's headers
	// do (a traceparent, say).
	Headers map[string]string
}

var identifier = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// NewOutboxRow builds the insert of job into hipq's outbox.
func NewOutboxRow(j Job, o OutboxOptions) (OutboxRow, error) {
	if j.Type == "" || j.Key == "" {
		return OutboxRow{}, fmt.Errorf("hipq: a job needs a Type and a Key")
	}
	value, err := j.IntakeJSON()
	if err != nil {
		return OutboxRow{}, fmt.Errorf("hipq: job %s/%s: %w", j.Type, j.Key, err)
	}
	table := "hipq_intake"
	if o.Schema != "" {
		if !identifier.MatchString(o.Schema) {
			return OutboxRow{}, fmt.Errorf("hipq: schema %q is not a plain identifier", o.Schema)
		}
		table = `"` + o.Schema + `".hipq_intake`
	}
	row := OutboxRow{SQL: "INSERT INTO " + table + " (value, headers) VALUES ($1, $2::jsonb)", Value: string(value)}
	if len(o.Headers) > 0 {
		h, err := json.Marshal(o.Headers)
		if err != nil {
			return OutboxRow{}, err
		}
		hs := string(h)
		row.Headers = &hs
	}
	return row, nil
}
