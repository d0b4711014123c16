-- feedback.lua: what the vendor said, made known to the whole fleet.
-- KEYS and ARGV as in lib.lua, for the rules the answer is about; then
-- ARGS.feedback (docs/PROTOCOL.md 2.6), times in µs:
--   id            the id the charges are made under;
--   as_of         the time of the call whose answer carried the counts, or 0;
--   pause         a pause from now (a 429's Retry-After), or 0;
--   left, reset   units left (or -1); time until the window resets (or 0);
--   known         the quota's epoch as the caller last saw it, or 0;
--   refused       1 when the vendor refused the call of as_of as over limit;
--   limit         the limit the vendor stated, or 0;
--   calls_left, calls_reset, calls_limit  the same for requests (PerCall);
--   late          how long after its slot the answer came, or 0;
--   refused_cost  the refused call's cost (read_cost), else "";
--   span          the policy's longest window, margin ceiling included;
--   named         how many ARGS.named follow: a rule's place (from 1), its
--                 named unit's left (or -1) and reset (or 0).

-- Returns REPLY.feedback: now, pause until (or 0), units charged, lowered
-- (1: a cap dropped), cap (the lowest capped limit, or -1), others (the
-- most a rule leaves others), measuring (1: a rule keeps a share), dropped
-- (1: a limit in force dropped).

local now = clock()
-- The arguments, read once (see the header).
local a = after_rules()
local arg
arg, a = ARGS.feedback(a)
arg.late = math.max(arg.late, 0)
local id, pause, left, reset = arg.id, arg.pause, arg.left, arg.reset
-- The counts of the rules that count a named unit, by their place.
local own = {}
for _ = 1, arg.named do
  local n
  n, a = ARGS.named(a)
  own[n.rule] = { left = n.left, reset = n.reset }
end
-- The policy's longest window, for loss_pause (with blind rules off).
local policy_span = arg.span
local as_of = arg.as_of
if as_of <= 0 or as_of > now then
  as_of = now
end

local rs = rules()
local meta = read_meta(true)
-- Margins use the lag so far; this answer's lateness holds it (note_lag).
margins(rs, fleet_spread(meta, now), held_spread(meta, now), meta and meta.warm_held > now, lag_of(meta, now))
local lag_changed = note_lag(meta, math.max(arg.late, arg.as_of > 0 and now - as_of or 0), arg.span, now)
local known = arg.known
local learn = arg.refused and arg.as_of > 0
local dirty, found = false, false
if meta or learn or pause > 0 and KEYS[2] == KEYS[1] then
  meta, dirty, found = check_loss(meta, now, known, rs, policy_span)
end
dirty = dirty or lag_changed
limits_in_force(rs, meta, now, true)
-- Blind rules measure no others, and a count may rebuild them (rebuild).
for _, r in ipairs(rs) do
  blind.read(r, meta, now)
end
-- count_of returns rule i's count: its name, left, reset and stated limit.
local function count_of(i, r)
  if r.per_call then
    return 'calls', arg.calls_left, arg.calls_reset, arg.calls_limit
  elseif own[i] then
    return 'own' .. i, own[i].left, own[i].reset, 0
  end
  return 'units', left, reset, arg.limit
end

-- takers lists, for each count, the places of the rules that take it.
local takers = {}
for i, r in ipairs(rs) do
  if r.kind ~= CONCURRENCY then
    local which = count_of(i, r)
    takers[which] = takers[which] or {}
    table.insert(takers[which], i)
  end
end

-- about_rules returns the places, among is (a count's takers), of the
-- rules it is about. Those are the lone taker, or those of the limit it
-- states, or of the shortest window its reset fits in (else the longest).
local function about_rules(is, reset, vlimit)
  if #is <= 1 or OFF.about then
    return is
  end
  local out = {}
  if vlimit > 0 then
    for _, i in ipairs(is) do
      if rs[i].conf == vlimit or rs[i].limit == vlimit then
        table.insert(out, i)
      end
    end
    return out
  end
  local fit, longest
  for _, i in ipairs(is) do
    local w = span_of(rs[i])
    if w >= reset and (not fit or w < fit) then
      fit = w
    end
    longest = math.max(longest or w, w)
  end
  for _, i in ipairs(is) do
    if span_of(rs[i]) == (fit or longest) then
      table.insert(out, i)
    end
  end
  return out
end

-- about[i] says whether rule i's count is about it.
local about = {}
for which, is in pairs(takers) do
  local _, _, rst, vlimit = count_of(is[1], rs[is[1]])
  for _, i in ipairs(about_rules(is, rst, vlimit)) do
    about[i] = true
  end
end

-- dropped_shared: a shared rule's limit in force dropped; the group hears.
-- capped[i]: rule i's cap was learned from this refusal.
local lowered, dropped, dropped_shared = 0, 0, false
local capped = {}
-- The refused call's cost, read once for its caps and its ':rj' entry.
local refused_cost = arg.refused_cost ~= '' and read_cost(arg.refused_cost) or nil
if learn then
  local cu = meta.caps_until
  for _, r in ipairs(rs) do
    local vlimit = r.per_call and arg.calls_limit or arg.limit
    local n = refused_cost and units(r, refused_cost) or 0
    if r.kind ~= CONCURRENCY and (vlimit <= 0 or about[r.i]) and learn_cap(r, as_of, n, meta, now, vlimit) then
      lowered, dropped, dropped_shared = 1, 1, dropped_shared or r.shared
      capped[r.i] = true
    end
  end
  dirty = dirty or meta.caps_until ~= cu
end
-- listed_in returns the units listed in key (members "id:units", scored
-- by the time they sit at) that sit in (lo, hi], or after lo for no hi.
local function listed_in(key, lo, hi)
  local n = 0
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', key, '(' .. str(lo), hi and str(hi) or '+inf')) do
    n = n + (tonumber(string.match(m, ':(%d+)$')) or 0)
  end
  return n
end

-- charged_in returns the units charged to rule r in (lo, hi], or after lo
-- for no hi: in its record, but not sent by the fleet.
local function charged_in(r, lo, hi)
  return listed_in(r.key .. ':ch', lo, hi)
end

-- Refused calls stay in the record, but the vendor mostly leaves them out:
-- ':rj' lists them for the others' measure (docs/PROTOCOL.md 3.11).
if refused_cost and arg.as_of > 0 and not OFF.others then
  for _, r in ipairs(rs) do
    local n = units(r, refused_cost)
    if n > 0 and (r.kind == LOG or r.kind == COUNTER) then
      local key = r.key .. ':rj'
      redis.call('ZREMRANGEBYSCORE', key, '-inf', str(now - r.window))
      redis.call('ZADD', key, str(as_of), id .. ':' .. n)
      expire(key, (as_of - now + r.window) / 1000)
    end
  end
end

-- refunded_in returns rule r's units refunded (settle.lua) since the call
-- of as_of, of calls booked in (lo, hi]; r.refunds caches the list.
local function refunded_in(r, lo, hi)
  if not r.refunds then
    r.refunds = {}
    for _, m in ipairs(redis.call('ZRANGEBYSCORE', r.key .. ':rf', '(' .. str(as_of), '+inf')) do
      local t, u = string.match(m, '^(%-?%d+):.*:(%d+)$')
      if t then
        r.refunds[#r.refunds + 1] = { tonumber(t), tonumber(u) }
      end
    end
  end
  local n = 0
  for _, f in ipairs(r.refunds) do
    if f[1] > lo and f[1] <= hi then
      n = n + f[2]
    end
  end
  return n
end

-- sent_in_window returns the units of rule r the fleet had sent in the
-- vendor's window span, as of the call of as_of; nil if the record may miss
-- some. Its bounds, widened by the spread, err towards more sent, so that a
-- measure errs low. Charges and refused calls are out, refunds since in.
local function sent_in_window(r, span)
  local d = math.max(fleet_spread(meta, now), r.margin / 4, 1000)
  local lo, hi = as_of - span - d, as_of + arg.late + d
  if as_of - span < now - r.kept and not OFF.lag then
    -- The record may have dropped part of the vendor's window: no measure
    -- (see Answers' lag in lib.lua).
    return nil
  end
  if r.kind == COUNTER then
    -- Every bucket the bounds touch counts whole.
    local n = 0
    local raw = redis.call('HGETALL', r.key)
    for k = 1, #raw, 2 do
      local b = tonumber(raw[k]) * r.width
      if b + r.width > lo and b <= hi then
        n = n + tonumber(raw[k + 1])
      end
    end
    lo, hi = lo - r.width, hi + r.width
    return n - charged_in(r, lo, hi) + refunded_in(r, lo, hi) - listed_in(r.key .. ':rj', lo, hi)
  end
  return redis.call('ZCOUNT', r.key, '(' .. str(lo), str(hi)) - charged_in(r, lo, hi) + refunded_in(r, lo, hi) -
    listed_in(r.key .. ':rj', lo, hi)
end

-- note_others measures what others spent in the vendor's window: its limit
-- (vlimit, else the rule's) less left, less what the fleet sent. It adds
-- it to rule r's share (Others' share in lib.lua); a share starts at half
-- a unit and ends under a tenth. It reports whether the share changed.
local function note_others(r, left, vlimit)
  if OFF.others or not meta or r.blind or (r.kind ~= LOG and r.kind ~= COUNTER) then
    return false
  end
  local o = r.oth or { vlim = 0, p = {}, sent = {}, share = NO_MEASURE }
  if vlimit > 0 then
    o.vlim = vlimit
  end
  local base = o.vlim > 0 and o.vlim or (r.cap and r.cap.lim or r.conf)
  local sent = sent_in_window(r, span_of(r))
  if not sent then
    return false
  end
  local m = math.floor(1000 * (base - left - sent) + 0.5)
  local grown = (r.reserve or 0) > 0 and m >= 1000 * r.reserve and not OFF.others_grow
  if grown then
    -- The others spent all the room left to them, share and spare: the
    -- vendor refuses what more they ask and counts none of it. The share
    -- doubles, at most halfway to the limit (docs/PROTOCOL.md 3.11).
    m = math.min(2 * m, math.floor((1000 * base + m) / 2))
  end
  local i = others_period(r, now)
  if m > (o.p[i] or NO_MEASURE) then
    -- A grown measure is not held steady: it is no estimate's error.
    o.p[i], o.sent[i] = m, grown and 0 or math.max(sent, 0)
  end
  others_share(r, o, now)
  if not r.oth and o.share < 500 then
    return false
  end
  r.oth = o
  if o.share < 100 then
    -- The others stopped, or were noise: the share goes.
    r.oth = nil
  end
  return true
end

-- Each count the vendor gave measures the others' share of its rules, one
-- that teaches (a refusal, whose call ':rj' above takes out of the fleet's
-- side, or a count of 0 left) too, but for a rule whose cap it taught: the
-- cap holds what the vendor accepted.
if meta then
  local cu = meta.caps_until
  for i, r in ipairs(rs) do
    local left, vlimit = arg.left, arg.limit
    if r.per_call then
      left, vlimit = arg.calls_left, arg.calls_limit
    elseif own[i] then
      left, vlimit = own[i].left, 0
    end
    local limit = r.limit
    if left >= 0 and about[i] and not capped[i] and note_others(r, left, vlimit) then
      write_limits(r, meta, now)
      if r.limit < limit then
        dropped, dropped_shared = 1, dropped_shared or r.shared
      elseif r.limit > limit and r.kind == LOG then
        -- Room the share gave back: a log's hint may say nothing fits there.
        -- A counter keeps no hint, and its caller declares none.
        redis.call('DEL', r.key .. ':next')
      end
    end
  end
  dirty = dirty or meta.caps_until ~= cu
end

local announce = found
local until_ = pause_until(meta and meta.pause or 0)
if pause > 0 and now + pause > until_ then
  until_ = now + pause
  if KEYS[2] == KEYS[1] then
    meta.pause, meta.paused_by = until_, PAUSED_BY_VENDOR
    dirty, announce = true, true
  else
    announce_key(until_, now)
    redis.call('SET', KEYS[2], str(until_), 'PX', math.ceil(pause / 1000) + SLACK)
  end
end

-- The vendor states its counts: any process's calls may go out as scouts.
if meta and meta.counted == 0 and (left >= 0 or arg.calls_left >= 0 or arg.named > 0) then
  meta.counted, dirty = 1, true
end
if dirty then
  write_meta(meta, rs)
end
if announce then
  announce_quota(meta, now)
end
if dropped == 1 then
  announce_lowered(meta, now, dropped_shared)
end

-- charged_after returns the units charged to rule r after time t, within
-- its window, and drops the charges that left it.
local function charged_after(r, t)
  if OFF.charges then
    return 0
  end
  redis.call('ZREMRANGEBYSCORE', r.key .. ':ch', '-inf', str(now - r.window))
  return charged_in(r, t)
end

-- The counts were taken when the answer came, at the latest. They hold
-- the fleet's calls booked until then, in flight at their estimate.
local taken = math.min(as_of + arg.late, now)
local charged = 0
local calls_left, calls_reset = arg.calls_left, arg.calls_reset
for i, r in ipairs(rs) do
  local left, reset = left, reset
  if r.per_call then
    left, reset = calls_left, calls_reset
  elseif own[i] then
    left, reset = own[i].left, own[i].reset
  end
  if left >= 0 and about[i] and not learn then
    local free
    -- Free in the window the vendor counted: from the call's arrival to
    -- when it took its counts. From now, it would charge calls gone since.
    local from = OFF.lag and now or as_of
    if r.kind == LOG then
      free = r.limit - redis.call('ZCOUNT', r.key, '(' .. str(from - r.window), str(taken)) - charged_after(r, taken)
    elseif r.kind == COUNTER then
      local used = 0
      local raw = redis.call('HGETALL', r.key)
      local oldest = oldest_bucket(r, from)
      for k = 1, #raw, 2 do
        local b = tonumber(raw[k])
        if b >= oldest and b * r.width <= taken then
          used = used + tonumber(raw[k + 1])
        end
      end
      free = r.limit - used - charged_after(r, bucket_of(taken, r.width) * r.width + r.width - 1)
    elseif r.kind == BUCKET then
      local tat = tat_of(r.key)
      free = bucket_free(r, tat, now)
    end
    if free and r.kind ~= BUCKET and not OFF.charge_refunds then
      -- Still count units settled back since the call's arrival: a count
      -- taken then holds them at their estimate (docs/PROTOCOL.md 3.11).
      free = free - refunded_in(r, from - r.window, taken)
    end
    -- A count below the fleet's belief also leaves the others their spare.
    -- The fleet takes what the vendor says is left, but not its last units.
    left = math.max(left - (r.spare or 0), 0)
    if free and free > left then
      -- The gap is charged where it leaves the window as the vendor's
      -- resets. ':ch' lists it, so that the answers of calls in flight
      -- together charge it once.
      local at = now
      if reset > 0 and r.kind ~= BUCKET then
        at = math.min(now, math.max(now + reset - r.window, now - r.window + 1))
      end
      change(r, id, 0, free - left, at, now)
      if r.kind ~= BUCKET then
        local key = r.key .. ':ch'
        redis.call('ZADD', key, str(at), id .. ':' .. str(free - left))
        redis.call('PEXPIRE', key, math.ceil((at - now + r.window) / 1000) + SLACK)
      end
      charged = math.max(charged, free - left)
    end
  end
end

-- Blind rules rebuilt. The charge above took the data to the vendor's
-- count, so a rule whose own count it is decides with it again for this
-- key (docs/PROTOCOL.md 2.6). RESET_SLACK (µs) allows whole-second resets.
local RESET_SLACK = 1000000

-- rebuild ends rule r's blindness from the vendor's count, alone when no
-- other rule takes it, and reports whether it did.
local function rebuild(r, left, reset, vlimit, alone)
  if OFF.rebuild or learn or left < 0 or arg.as_of <= 0 or not meta or known ~= meta.epoch then
    return false
  end
  if not r.blind or arg.as_of < blind.settled(r) or reset > span_of(r) + r.margin + RESET_SLACK or
      not alone and vlimit ~= r.conf then
    return false
  end
  redis.call('SET', r.key .. ':rb', str(now), 'PX', math.ceil((r.blind_until - now) / 1000) + SLACK)
  return true
end

local seen_until = 0
for i, r in ipairs(rs) do
  local which, l, rst, vlimit = count_of(i, r)
  if rebuild(r, l, rst, vlimit, #(takers[which] or {}) == 1) then
    seen_until = math.max(seen_until, r.blind_until)
  end
end
-- Calls booked to the end of the blindness may move to the room it left.
announce_room(meta, rs, seen_until, now)

local cap, others, measuring = -1, 0, 0
for _, r in ipairs(rs) do
  if r.cap and (cap < 0 or r.cap.lim < cap) then
    cap = r.cap.lim
  end
  if r.oth then
    others, measuring = math.max(others, r.reserve), 1
  end
end
local out = {}
out[REPLY.feedback.now], out[REPLY.feedback.pause], out[REPLY.feedback.charged] = str(now), str(until_), charged
out[REPLY.feedback.lowered], out[REPLY.feedback.cap], out[REPLY.feedback.others] = lowered, cap, others
out[REPLY.feedback.measuring], out[REPLY.feedback.dropped] = measuring, dropped
return out
