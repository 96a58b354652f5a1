-- uses: log_lib
-- ARGV: prefix, key, scope, request_id, result, now
complete(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
return 1
