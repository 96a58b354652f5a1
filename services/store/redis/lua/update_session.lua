-- uses: sessions_lib update_lib
-- ARGV: prefix, id, expected, new_version, data, token, run, labels, created, retain, last_active.
-- Returns {code, last_active} (see update).
local code, last = update(ARGV[1], ARGV, 2)
return {code, last}
