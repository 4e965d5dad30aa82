-- hipq schema, version 18: the dashboard's sessions. The browser's cookie
-- holds a random id; only its SHA-256 is stored, with the HMAC of the
-- token signed in with (under the dashboard's key, never the token
-- itself) and the role that token had. Each request checks the token is
-- still configured with that role, so removing it from the config ends
-- its sessions. expires_at slides forward while the session is used;
-- expired rows are deleted at each sign-in. Safe to run again (IF NOT
-- EXISTS).
CREATE TABLE IF NOT EXISTS hipq_ui_session (
    id_hash    bytea       PRIMARY KEY,
    token_hash bytea       NOT NULL,
    role       text        NOT NULL CHECK (role IN ('admin', 'read')),
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS hipq_ui_session_expires ON hipq_ui_session (expires_at);
