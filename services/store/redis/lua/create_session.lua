-- uses: sessions_lib
-- ARGV: prefix, id, data, token, run, labels, created, retain, last_active. 1 ok, 0 exists, -1 token taken.
return create(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9])
