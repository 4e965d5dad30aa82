-- hipq schema, version 2: the claim as one server-side call, so throttles,
-- shares, per-type caps and time windows cost one round trip per batch.

-- (The claim's SQL function that this version defined or changed is no
-- longer kept here: the claim is decided in Go since version 20, which drops
-- whatever version of it a database holds.)

