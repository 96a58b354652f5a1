-- uses: sessions_lib
-- ARGV: prefix, id
return drop(ARGV[1], ARGV[2])
