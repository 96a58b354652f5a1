-- uses: log_lib
-- ARGV: prefix, id, now
touch(ARGV[1], ARGV[2], ARGV[3])
return 0
