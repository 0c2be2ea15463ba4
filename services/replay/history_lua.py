"""Lua scripts of the per-question history: the atomic, idempotent report and the import (key schema: `history.py`).

Both scripts start with `PRELUDE`: the pool must exist (else `{-1}`), the pool's history settings are fixed by its
first report or import (HSETNX), and `store` keeps the pass-rate index, the filter sets and the pool's counters in
step with a question's record, so GetPoolStats reads counters instead of scanning questions. Writes are gathered
and sent in batches at the end of a call (`flush`).

A record is binary (`question_history.RECORD_HEAD`): the `RECORD_FIELDS` as big-endian doubles (exact for the
integers below 2^53 that requests allow), the window's length, then its attempts and successes as uint32 (oldest
visit first). Numbers sent back as text use `%.17g`: Lua 5.1's `tostring` keeps 14 digits.
"""

PRELUDE = """
local p, pools_key, pool = ARGV[1], ARGV[2], ARGV[3]
if redis.call('SISMEMBER', pools_key, pool) == 0 then return {-1} end
local hmeta, hist = p .. ':hmeta', p .. ':hist'
redis.call('HSETNX', hmeta, 'window', ARGV[4])
redis.call('HSETNX', hmeta, 'alpha', ARGV[5])
redis.call('HSETNX', hmeta, 'mastered_rate', ARGV[6])
redis.call('HSETNX', hmeta, 'mastered_visits', ARGV[7])
local settings = redis.call('HMGET', hmeta, 'window', 'alpha', 'mastered_rate', 'mastered_visits')
local W, alpha = tonumber(settings[1]), tonumber(settings[2])
local mastered_rate, mastered_visits = tonumber(settings[3]), tonumber(settings[4])
-- A record in Lua is a flat array: the 13 fields of question_history.RECORD_FIELDS (indices below), the window's
-- length n at [14], its attempts at [15 .. 14+n] and successes at [15+n .. 14+2n]. Flat arrays and struct (C) keep
-- a report near 8 us of Redis time a question; named tables, text records and per-question calls took 25.
local VISITS, ATTEMPTS, SUCCESSES, REWARD_SUM, EMA, FIRST_STEP, LAST_STEP = 1, 2, 3, 4, 5, 6, 7
local FIRST_VERSION, LAST_VERSION, TIMES_REPLAYED, REPLAYED_ROWS, TIMES_RESCUED, LAST_SOLVED = 8, 9, 10, 11, 12, 13
local N = 14
local HEAD_BYTES = 8 * 13 + 1
local FORMAT = {}
for n = 1, 64 do FORMAT[n] = '>' .. string.rep('d', 13) .. 'B' .. string.rep('I4', 2 * n) end

local function num(x) return string.format('%.17g', x) end
local function decode(text)
  local v = {struct.unpack(FORMAT[struct.unpack('B', text, HEAD_BYTES)], text)}
  v[#v] = nil  -- unpack's last value is the next position
  return v
end
local function encode(v) return struct.pack(FORMAT[v[N]], unpack(v)) end
-- Appends a visit to the window and keeps its last W visits.
local function visit(v, att, suc)
  local n, wa, ws = v[N], {}, {}
  for k = 1, n do wa[k], ws[k] = v[N + k], v[N + n + k] end
  wa[n + 1], ws[n + 1] = att, suc
  local drop = math.max(0, n + 1 - W)
  n = n + 1 - drop
  for k = 1, n do v[N + k], v[N + n + k] = wa[k + drop], ws[k + drop] end
  for k = #v, N + 2 * n + 1, -1 do v[k] = nil end
  v[N] = n
end
-- The IEEE-754 bits of a non-negative double, big-endian, as hex: they sort as the numbers do, so a lexical
-- index orders questions by pass rate and pages of it resume after the last member seen.
local function hex(x)
  return string.format('%02x%02x%02x%02x%02x%02x%02x%02x', string.byte(struct.pack('>d', x), 1, 8))
end
-- Where a record sits: its index member ("<rate>:<qid>"), pass-rate bucket (integer arithmetic: 0.3 * 10 is
-- 2.999... in doubles), mastered, never solved.
local function place(qid, v)
  local n, a, s = v[N], 0, 0
  for k = 1, n do a = a + v[N + k]; s = s + v[N + n + k] end
  local rate = s / a
  return hex(rate) .. ':' .. qid, 'b' .. math.min(math.floor(10 * s / a), 9),
    n >= mastered_visits and rate >= mastered_rate, v[SUCCESSES] == 0
end
-- Writes are gathered and sent in batches at the end (`flush`): one HSET, ZREM and ZADD per batch of questions and
-- one HINCRBY per counter, instead of a few calls per question.
local BATCH = 1000  -- arguments per call; Lua 5.1's unpack fails past ~8,000
local counts, writes = {}, {}
local removed = {[':hrate'] = {}, [':hnever'] = {}, [':hmastered'] = {}}
local added = {[':hrate'] = {}, [':hnever'] = {}, [':hmastered'] = {}}
local function count(name, delta) counts[name] = (counts[name] or 0) + delta end
local function batched(command, key, list)
  for first = 1, #list, BATCH do
    redis.call(command, key, unpack(list, first, math.min(first + BATCH - 1, #list)))
  end
end
local function read(qids)  -- their stored records (false where none), in batches
  local texts = {}
  for first = 1, #qids, BATCH do
    local got = redis.call('HMGET', hist, unpack(qids, first, math.min(first + BATCH - 1, #qids)))
    for k = 1, #got do texts[first + k - 1] = got[k] end
  end
  return texts
end
local function flush()
  batched('HSET', hist, writes)
  for key, list in pairs(removed) do batched('ZREM', p .. key, list) end
  for key, list in pairs(added) do batched('ZADD', p .. key, list) end
  for name, delta in pairs(counts) do
    if delta ~= 0 then redis.call('HINCRBY', hmeta, name, delta) end
  end
end
local function remove(key, member) local list = removed[key]; list[#list + 1] = member end
local function add(key, member) local list = added[key]; list[#list + 1] = 0; list[#list + 1] = member end
-- Moves one set's membership and count from (was, old member) to (now, new member).
local function move(key, counter, was, now, old, new)
  if was and (not now or old ~= new) then remove(key, old) end
  if now and (not was or old ~= new) then add(key, new) end
  if was and not now then count(counter, -1) elseif now and not was then count(counter, 1) end
end
-- Stores a question's record and moves it from its old place (old member nil: a new question) to its new one in
-- the index, the filter sets and the counters. A question comes once per call: removals and additions never collide.
local function store(qid, v, old, old_bucket, old_mastered, old_never)
  writes[#writes + 1] = qid
  writes[#writes + 1] = encode(v)
  local member, bucket, mastered, never = place(qid, v)
  if not old then count('questions', 1) end
  if old ~= member then
    if old then remove(':hrate', old) end
    add(':hrate', member)
  end
  move(':hnever', 'never', old_never, never, old, member)
  move(':hmastered', 'mastered', old_mastered, mastered, old, member)
  if old then count(old_bucket, -1) end
  count(bucket, 1)
end
"""

# ARGV: prefix, pools key, pool, 4 settings, run id, step, policy version, max runs, n question metas,
# (question id, Question proto) x n, the outcomes' numbers packed as `history.OUTCOME` (attempts, successes, mean
# reward, replayed, rescued) one after another, then the outcomes' question ids in the same order (one argument per
# outcome instead of six: redis-py's per-argument cost was a tenth of a report). Returns {-1} for an unknown pool,
# else {recorded, duplicate 0|1, the run's last step}.
REPORT_SCRIPT = (
    PRELUDE
    + """
local run, step, version = ARGV[8], tonumber(ARGV[9]), tonumber(ARGV[10])
local max_runs, nq = tonumber(ARGV[11]), tonumber(ARGV[12])
local last = redis.call('HGET', p .. ':hrunstep', run)
if last and tonumber(last) >= step then return {0, 1, last} end
local i = 13
for _ = 1, nq do
  redis.call('HSETNX', p .. ':qmeta', ARGV[i], ARGV[i + 1])
  i = i + 2
end
local recorded, rescues, replayed_rows = 0, 0, 0
local blob, qids = ARGV[i], {}
for k = i + 1, #ARGV do qids[#qids + 1] = ARGV[k] end
local texts, pos = read(qids), 1
for n, qid in ipairs(qids) do
  local att, suc, reward, replayed, rescued
  att, suc, reward, replayed, rescued, pos = struct.unpack('>I4I4dI4B', blob, pos)
  local v, old, old_bucket, old_mastered, old_never
  if texts[n] then
    v = decode(texts[n])
    old, old_bucket, old_mastered, old_never = place(qid, v)
    v[EMA] = alpha * suc / att + (1 - alpha) * v[EMA]
  else
    v = {0, 0, 0, 0, suc / att, step, step, version, version, 0, 0, 0, -1, 0}
  end
  v[VISITS], v[ATTEMPTS], v[SUCCESSES] = v[VISITS] + 1, v[ATTEMPTS] + att, v[SUCCESSES] + suc
  v[REWARD_SUM] = v[REWARD_SUM] + reward * att
  v[LAST_STEP], v[LAST_VERSION] = step, version
  if replayed > 0 then v[TIMES_REPLAYED], v[REPLAYED_ROWS] = v[TIMES_REPLAYED] + 1, v[REPLAYED_ROWS] + replayed end
  if rescued == 1 then v[TIMES_RESCUED] = v[TIMES_RESCUED] + 1; rescues = rescues + 1 end
  if suc > 0 then v[LAST_SOLVED] = step end
  visit(v, att, suc)
  store(qid, v, old, old_bucket, old_mastered, old_never)
  recorded, replayed_rows = recorded + 1, replayed_rows + replayed
end
count('reports', 1)
count('rescues', rescues)
count('replayed_rows', replayed_rows)
flush()
-- The duplicate check remembers each run's last step; past max_runs runs the least recently reporting is forgotten.
redis.call('ZADD', p .. ':hruns', redis.call('HINCRBY', hmeta, 'run_seq', 1), run)
redis.call('HSET', p .. ':hrunstep', run, num(step))
if redis.call('ZCARD', p .. ':hruns') > max_runs then
  local oldest = redis.call('ZRANGE', p .. ':hruns', 0, 0)[1]
  redis.call('ZREM', p .. ':hruns', oldest)
  redis.call('HDEL', p .. ':hrunstep', oldest)
end
return {recorded, 0, num(step)}
"""
)

# ARGV: prefix, pools key, pool, 4 settings, then (question id, record) pairs, records checked beforehand. A
# question that already has history keeps it: an import never overwrites what reports built, and running the same
# import again changes nothing. Returns {-1} for an unknown pool, else {imported, kept}.
IMPORT_SCRIPT = (
    PRELUDE
    + """
local imported, kept = 0, 0
local qids, seen = {}, {}
for k = 8, #ARGV, 2 do qids[#qids + 1] = ARGV[k] end
local texts = read(qids)
for n, qid in ipairs(qids) do
  if texts[n] or seen[qid] then  -- a question named twice in one call is kept as its first record
    kept = kept + 1
  else
    seen[qid] = true
    local v = decode(ARGV[7 + 2 * n])
    local n_window = v[N]
    if n_window > W then  -- keep the last W visits of a longer window
      local first = {unpack(v, 1, N)}
      for k = 1, W do first[N + k], first[N + W + k] = v[N + n_window - W + k], v[N + 2 * n_window - W + k] end
      first[N] = W
      v = first
    end
    store(qid, v)
    count('rescues', v[TIMES_RESCUED])
    count('replayed_rows', v[REPLAYED_ROWS])
    imported = imported + 1
  end
end
flush()
return {imported, kept}
"""
)
