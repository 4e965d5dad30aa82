// Package schemas embeds hipq's SQL migrations and the JSON Schemas of the
// messages it reads and writes.
package schemas

import "embed"

// Migrations holds migrations/NNNN_name.sql, applied in order by the store.
//
//go:embed migrations/*.sql
var Migrations embed.FS

// JSON holds the JSON Schemas of intake requests, envelopes and replies.
//
//go:embed json/*.json
var JSON embed.FS
