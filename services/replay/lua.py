"""The replay pool's Lua scripts: the atomic idempotent add and the uniform draw (key schema: `store.py`)."""

ADD_SCRIPT = """
local p, pools_key, pool = ARGV[1], ARGV[2], ARGV[3]
local cap, eviction, nq = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local meta = p .. ':meta'
redis.call('SADD', pools_key, pool)
-- A pool created by this script keeps `counts` (successes -> questions holding that many) from its first add,
-- so GetPoolStats reads a few fields instead of every question; older pools lack the `counted` mark.
if redis.call('HSETNX', meta, 'capacity', cap) == 1 then redis.call('HSET', meta, 'counted', 1) end
redis.call('HSETNX', meta, 'eviction', eviction)
local counted = redis.call('HEXISTS', meta, 'counted') == 1
local i = 7
for _ = 1, nq do
  redis.call('HSET', p .. ':qmeta', ARGV[i], ARGV[i + 1])
  i = i + 2
end
local function remove(qk, tid)
  local aux = redis.call('HGET', qk .. ':aux', tid)
  local ver, len, bytes, bucket = string.match(aux, '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
  len = tonumber(len)
  redis.call('HDEL', qk .. ':data', tid)
  redis.call('HDEL', qk .. ':aux', tid)
  redis.call('ZREM', qk .. ':ids', tid)
  redis.call('ZREM', qk .. ':ver', tid)
  redis.call('ZREM', qk .. ':prio', tid)
  redis.call('HINCRBY', meta, 'trajectories', -1)
  redis.call('HINCRBY', meta, 'payload_bytes', -tonumber(bytes))
  redis.call('HINCRBY', meta, 'tokens_sum', -len)
  redis.call('HINCRBY', meta, 'tokens_sq_sum', -len * len)
  redis.call('HINCRBY', p .. ':versions', ver, -1)
  redis.call('HINCRBY', p .. ':lengths', bucket, -1)
end
local added, duplicate, evicted = 0, 0, 0
local status = {}
while i <= #ARGV do
  local qid, tid, payload = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local prio, ver, len, bucket = ARGV[i + 3], ARGV[i + 4], tonumber(ARGV[i + 5]), ARGV[i + 6]
  i = i + 7
  local qk = p .. ':q:' .. qid
  if redis.call('HEXISTS', qk .. ':data', tid) == 1 then
    duplicate = duplicate + 1
  else
    local seq = redis.call('HINCRBY', meta, 'seq', 1)
    redis.call('HSET', qk .. ':data', tid, payload)
    redis.call('HSET', qk .. ':aux', tid, ver .. '|' .. len .. '|' .. #payload .. '|' .. bucket)
    redis.call('ZADD', qk .. ':ids', seq, tid)
    redis.call('ZADD', qk .. ':ver', ver, tid)
    redis.call('ZADD', qk .. ':prio', prio, tid)
    redis.call('SADD', p .. ':questions', qid)
    redis.call('HINCRBY', meta, 'trajectories', 1)
    redis.call('HINCRBY', meta, 'payload_bytes', #payload)
    redis.call('HINCRBY', meta, 'tokens_sum', len)
    redis.call('HINCRBY', meta, 'tokens_sq_sum', len * len)
    redis.call('HINCRBY', p .. ':versions', ver, 1)
    redis.call('HINCRBY', p .. ':lengths', bucket, 1)
    added = added + 1
    local held = redis.call('ZCARD', qk .. ':ids')
    if held > tonumber(redis.call('HGET', meta, 'capacity')) then
      local order = redis.call('HGET', meta, 'eviction') == 'oldest' and ':ids' or ':prio'
      remove(qk, redis.call('ZRANGE', qk .. order, 0, 0)[1])
      evicted = evicted + 1
    elseif counted then  -- the question moved from held - 1 successes to held (an eviction keeps its count)
      if held > 1 then redis.call('HINCRBY', p .. ':counts', held - 1, -1) end
      redis.call('HINCRBY', p .. ':counts', held, 1)
    end
  end
end
return {added, duplicate, evicted}
"""

# Uniform sampling for a whole step in one call. ARGV: prefix, pools key, pool, min_version, m,
# then (question id, LCG seed) pairs. Returns {-1} for an unknown pool, else per question:
# available, picked, payload... The index draw mirrors core.choose_uniform_indices exactly.
# A question's payloads come from one HMGET: each redis.call costs a few microseconds, and per-pick
# HGETs were a fifth of a 512-question step's time in Redis.
SAMPLE_UNIFORM_SCRIPT = """
local p, pools_key, pool = ARGV[1], ARGV[2], ARGV[3]
if redis.call('SISMEMBER', pools_key, pool) == 0 then return {-1} end
local min_version, m = tonumber(ARGV[4]), tonumber(ARGV[5])
local out = {}
for a = 6, #ARGV, 2 do
  local qk = p .. ':q:' .. ARGV[a]
  local key = qk .. ':ver'
  local n = min_version > 0 and redis.call('ZCOUNT', key, min_version, '+inf') or redis.call('ZCARD', key)
  local k = math.min(m, n)
  out[#out + 1] = n
  out[#out + 1] = k
  local state, swapped, tids = tonumber(ARGV[a + 1]), {}, {}
  for i = 0, k - 1 do
    state = (state * 48271) % 2147483647
    local j = i + state % (n - i)
    local index = swapped[j] or j
    swapped[j] = swapped[i] or i
    if min_version > 0 then
      tids[i + 1] = redis.call('ZRANGEBYSCORE', key, min_version, '+inf', 'LIMIT', index, 1)[1]
    else
      tids[i + 1] = redis.call('ZRANGE', key, index, index)[1]
    end
  end
  if k > 0 then
    for _, payload in ipairs(redis.call('HMGET', qk .. ':data', unpack(tids))) do
      out[#out + 1] = payload
    end
  end
end
return out
"""
