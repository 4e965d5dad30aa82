// Package correlator is hipq's domain: jobs, their states and outcomes, the
// transition table, retry policies, the decoding of intake requests, the
// classification of replies and time-window maths.
//
// It imports nothing of hipq's and does no I/O, so every rule here can be
// tested as a table.
//
// # State model
//
//	           claim                reply ok / retry exhausted
//	initial ─────────▶ running ─────────────────────────────▶ final
//	   │                 │ ▲                                   ▲
//	   │                 │ │ claim                             │
//	   │      failure /  ▼ │                                   │
//	   │      timeout  error ──▶ retry ────────────────────────┤
//	   │                 (resolved in the same transaction)    │
//	   └──────────── expire / cancel ──────────────────────────┘
//
// error is transient: the retry policy resolves it in the transaction that
// records it, so a committed row is never left in error. Every end of a
// running attempt has a name here (Replied, TimedOut, DispatchFailed,
// SendUnknown, ReplyUnstorable), as every deferral (Defer); the store
// writes what they decide, each write guarded by the job's expected state
// and attempt.
package correlator
