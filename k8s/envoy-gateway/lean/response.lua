-- The lean profile's response reader (Envoy Lua filter, response side only). See docs/architecture.md.
--
-- The sidecar admits a request on the ext_proc stream and, in its reply, writes dynamic metadata under the
-- `extproc` namespace: `id` (the key its end report is matched by) and `read`, a reading spec built from
-- the API's response dialect (extproc/admission/reading.py): Lua patterns that mark a content event, a final
-- event, an error event and the usage-only event, the JSON key that holds usage (`usage_key`, quoted, for a
-- quick plain search), and whether to strip the usage-only event (the sidecar injected `stream_options.include_usage`; the client did not ask for it).
-- This script knows no API: it applies the patterns and writes what it saw to `extproc.response`, which
-- Envoy's gRPC access log hands to the sidecar when the request ends:
--   n  content events counted          m  n when the last usage object was seen
--   u0 the first usage object (text)   u  the last usage object (text)
--   f  a final event was seen          e  an error event was seen
--   x  the body ended (end of stream)  b  a JSON body, whole     t  the end of a larger JSON body
--   t1 when the first content event arrived (ms since the epoch, Envoy's clock): with the access log's
--      request start and last upstream byte it gives the sidecar the first-token delay and the decode rate
-- Envoy runs no Lua when a client disconnects, so every value is written as soon as it changes.
-- Handles from streamInfo() expire at each yield (every chunk): they are fetched again each time.

local IN = "extproc"
local OUT = "extproc.response"
local HOLD_MAX = 65536 -- an incomplete SSE event is held (and, when stripping, withheld) up to this size
local BODY_MAX = 65536 -- a JSON body is handed over whole up to this size...
local TAIL = 8192 -- ...and past it only its end, where the usage object is written

local function set(handle, key, value)
  handle:streamInfo():dynamicMetadata():set(OUT, key, value)
end

local function matches(text, patterns)
  if patterns ~= nil then
    for _, pattern in ipairs(patterns) do
      if string.find(text, pattern) ~= nil then
        return true
      end
    end
  end
  return false
end

-- One complete SSE event: whether to drop it from the client's stream. Most events are content: those are
-- neither final nor errors, so the other patterns run only for the rest.
local function classify(event, spec, state)
  if matches(event, spec.content) and not matches(event, spec.not_content) then
    state.n = state.n + 1
  else
    if matches(event, spec.final) then
      state.final = true
    end
    if matches(event, spec.error) then
      state.error = true
    end
  end
  if string.find(event, spec.usage_key, 1, true) == nil then
    return false -- a plain search first: the usage pattern runs only where the key is
  end
  local usage = string.match(event, spec.usage)
  if usage ~= nil then
    if state.u0 == nil then
      state.u0 = usage
    end
    state.u = usage
    state.m = state.n
    return spec.strip and spec.only ~= nil and string.find(event, spec.only) ~= nil
  end
  return false
end

local function publish(handle, state, seen)
  if seen.n == 0 and state.n > 0 then
    set(handle, "t1", handle:timestamp())
  end
  if state.n ~= seen.n then
    set(handle, "n", state.n)
    seen.n = state.n
  end
  if state.u ~= seen.u then
    if seen.u == nil then
      set(handle, "u0", state.u0)
    end
    set(handle, "u", state.u)
    set(handle, "m", state.m)
    seen.u = state.u
  end
  if state.final and not seen.final then
    set(handle, "f", true)
    seen.final = true
  end
  if state.error and not seen.error then
    set(handle, "e", true)
    seen.error = true
  end
end

local function read_events(handle, spec)
  local state = { n = 0, m = 0, final = false, error = false }
  local seen = { n = 0, final = false, error = false }
  local held = ""
  for chunk in handle:bodyChunks() do
    local size = chunk:length()
    local text = size > 0 and chunk:getBytes(0, size) or ""
    local was_held = #held > 0
    if was_held then
      text = held .. text
    end
    local kept = spec.strip and {} or nil
    local dropped = false
    local pos = 1
    while true do
      local first, last = string.find(text, "\r?\n\r?\n", pos)
      if first == nil then
        break
      end
      local event = string.sub(text, pos, last)
      if classify(event, spec, state) then
        dropped = true
      elseif kept ~= nil then
        kept[#kept + 1] = event
      end
      pos = last + 1
    end
    held = string.sub(text, pos)
    if #held > HOLD_MAX or (size == 0 and #held > 0) then
      -- Too large to be a usage event, or the end of the stream (an empty last chunk): released as it is.
      if kept ~= nil then
        kept[#kept + 1] = held
      end
      held = ""
    end
    -- Only a stripping reader changes bytes, and only when it dropped an event or holds part of one:
    -- otherwise the chunk passes untouched (no copy). A counting reader keeps a partial event for parsing.
    if kept ~= nil and (dropped or was_held or #held > 0) then
      chunk:setBytes(table.concat(kept))
    end
    publish(handle, state, seen)
  end
end

local function read_body(handle)
  local parts, size, tail = {}, 0, nil
  for chunk in handle:bodyChunks() do
    local length = chunk:length()
    if length > 0 then
      local bytes = chunk:getBytes(0, length)
      if tail == nil and size + length <= BODY_MAX then
        parts[#parts + 1] = bytes
      else
        tail = string.sub((tail or table.concat(parts)) .. bytes, -TAIL)
        parts = {}
      end
      size = size + length
    end
  end
  if tail == nil then
    set(handle, "b", table.concat(parts))
  else
    set(handle, "t", tail)
  end
end

function envoy_on_response(handle)
  local admitted = handle:streamInfo():dynamicMetadata():get(IN)
  if admitted == nil or admitted.read == nil then
    return -- not admitted by the lean profile (refused, free path): nothing to read
  end
  local spec = admitted.read
  local kind = handle:headers():get("content-type") or ""
  if string.find(kind, "text/event-stream", 1, true) ~= nil then
    read_events(handle, spec)
  else
    read_body(handle)
  end
  set(handle, "x", true)
end
