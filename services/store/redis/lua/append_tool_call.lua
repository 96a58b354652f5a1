-- uses: log_lib
-- ARGV: prefix, session id, episode, request_id, entry JSON. Returns the episode's entry count.
return append(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
