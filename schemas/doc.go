// Package schemas embeds hipq's SQL migrations and the JSON Schemas of the
// messages it reads and writes.
package schemas

import "embed"

// Migrations holds migrations/NNNN_name.sql, applied in order by the store.
//
//go:embed migrations/*.sql
var Migrations embed.FS

// Repeatable holds repeatable/NAME.sql: each defines SQL functions with
// CREATE OR REPLACE, and is applied by the store after the versioned
// migrations whenever its text changes. A function lives in one such
// file only; the versioned migrations hold no copies.
//
//go:embed repeatable/*.sql
var Repeatable embed.FS

// JSON holds the JSON Schemas of intake requests, envelopes and replies.
//
//go:embed json/*.json
var JSON embed.FS
