-- uses: requests_lib
-- ARGV: prefix, key, scope, request_id, owner, now, nonce.
-- Returns {created, state, owner, result, created_at, finished_at}.
return claim(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
