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
// records it, so a committed row is never left in error. Every write that
// moves a job is guarded by the job's expected state and attempt; the store
// package turns the transitions below into SQL guards.
package correlator
