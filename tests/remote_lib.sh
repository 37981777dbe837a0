# Helpers for replicas of kvq serve sharing a redis-server (sourced by
# test_prefix_cache_remote.sh and bench/prefix_remote.sh). Needs $kvq, $model, $tmp.
here_lib=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
resp_py=$here_lib/server/resp.py
pids=()
trap 'for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done; wait; [ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"' EXIT

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# start_redis [PORT]: redis-server on loopback, no persistence, LRU eviction; sets
# rport and redis_pid (a new free port unless PORT is given; another one if a
# parallel test took it first).
start_redis() {
  local try
  for try in 1 2 3; do
    rport=${1:-$(free_port)}
    redis-server --port "$rport" --bind 127.0.0.1 --save '' --appendonly no --dir "$tmp" \
      --maxmemory 512mb --maxmemory-policy allkeys-lru >>"$tmp/redis.log" 2>&1 &
    redis_pid=$!
    pids+=("$redis_pid")
    for _ in $(seq 100); do
      kill -0 "$redis_pid" 2>/dev/null || break
      [ "$(redis-cli -p "$rport" ping 2>/dev/null)" = PONG ] && return 0
      sleep 0.05
    done
    [ -n "${1:-}" ] && break
  done
  echo "redis-server did not start on port $rport:"; tail -5 "$tmp/redis.log"
  exit 1
}
stop_redis() { kill -KILL "$redis_pid" 2>/dev/null; wait "$redis_pid" 2>/dev/null; }

# start_replica NAME ARGS...: kvq serve on a free port; sets NAME_port and NAME_pid.
start_replica() {
  local name=$1 port="" pid
  shift
  "$kvq" serve -m "$model" --host 127.0.0.1 --port 0 "$@" >"$tmp/$name.log" 2>&1 &
  pid=$!
  pids+=("$pid")
  for _ in $(seq 300); do
    port=$(grep -o 'listening on http://[0-9.]*:[0-9]*' "$tmp/$name.log" 2>/dev/null | sed 's/.*://')
    [ -n "$port" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if [ -z "$port" ]; then echo "server $name did not start:"; cat "$tmp/$name.log"; exit 1; fi
  printf -v "${name}_port" %s "$port"
  printf -v "${name}_pid" %s "$pid"
}

# complete PORT KEY PROMPT [MAX_TOKENS]: a greedy completion of $tmp/PROMPT.txt
# (prompt_cache_key KEY, none when empty); the answer in $tmp/answer.json.
complete() {
  jq -Rs --arg k "$2" --argjson n "${4:-16}" \
    '{prompt: ., max_tokens: $n, temperature: 0} + (if $k == "" then {} else {prompt_cache_key: $k} end)' "$tmp/$3.txt" |
    curl -s -m 120 "http://127.0.0.1:$1/v1/completions" -H 'Content-Type: application/json' -d @- >"$tmp/answer.json"
}
answer_text() { jq -rs '.[0].choices[0].text // "(no text)"' "$tmp/answer.json"; }
answer_cached() { jq -rs '.[0].usage.prompt_tokens_details.cached_tokens // -1' "$tmp/answer.json"; }

# metric PORT NAME: a value from /metrics (without the kvq_ prefix).
metric() { curl -s -m 10 "http://127.0.0.1:$1/metrics" | awk -v m="kvq_$2" '$1 == m { print $2 }'; }

# wait_metric PORT NAME MIN [SECONDS]: until the metric reaches MIN; false at the deadline.
wait_metric() {
  local i v
  for i in $(seq $((${4:-20} * 10))); do
    v=$(metric "$1" "$2")
    [ -n "$v" ] && awk -v v="$v" -v m="$3" 'BEGIN { exit !(v >= m) }' && return 0
    sleep 0.1
  done
  return 1
}

# prompt_file NAME OFFSET CHARS: text from WikiText-2 as a prompt.
prompt_file() { tail -c +"$2" "$shared/data/wikitext2-test.txt" | head -c "$3" >"$tmp/$1.txt"; }
