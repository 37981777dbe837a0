#!/usr/bin/env bash
# kvq serve renders the chat template the GGUF carries: a copy of tinydoc with
# Gemma 3's template as tokenizer.chat_template and Llama 3.1's as
# tokenizer.chat_template.tool_use. Each request's prompt_tokens must equal the
# token count of the prompt Python's jinja2 renders from the same template (its
# leading BOS text dropped, as the tokenizer adds BOS); a conversation the template
# refuses gets a 400 with its message. Also --chat-template FILE, chat_template_kwargs
# and bad choices.
set -u
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
here=$(cd "$(dirname "$0")" && pwd)
model=$shared/models/tinydoc-q8_0.gguf
tpl=$here/chat_templates
need_asset "$model"
command -v curl >/dev/null || { echo "SKIP: curl is not installed"; exit 77; }
python3 -c "import jinja2" 2>/dev/null || { echo "SKIP: python3-jinja2 is not installed"; exit 77; }

srv_pid=""
trap '[ -n "$srv_pid" ] && kill -TERM $srv_pid 2>/dev/null; wait; rm -rf "$tmp"' EXIT

python3 "$tpl/gguf_with_template.py" "$model" "$tmp/model.gguf" \
  "tokenizer.chat_template=$tpl/gemma-3.jinja" "tokenizer.chat_template.tool_use=$tpl/llama-3.1.jinja" ||
  { echo "FAIL: cannot write the GGUF copy"; exit 1; }

start_server() { # NAME ARGS...
  serve_start "$1" -t 2 --max-num-seqs 2 --prefix-cache-mb 0 "${@:2}" || exit 1
}
stop_server() { kill -TERM $srv_pid; wait $srv_pid; srv_pid=""; }

# expected_tokens TEMPLATE BODY: tokens of jinja2's rendering of BODY's messages/tools
expected_tokens() {
  python3 - "$1" "$2" "$tpl" >"$tmp/expected.txt" <<'PY' || return 1
import json, sys
sys.path.insert(0, sys.argv[3])
import jinja2_reference as ref
body = json.loads(sys.argv[2])
with open(sys.argv[1], encoding="utf-8") as f:
    src = f.read()
out = ref.environment().from_string(src).render(**body.get("chat_template_kwargs", {}), messages=body["messages"],
                                                tools=body.get("tools"), documents=None, add_generation_prompt=True,
                                                bos_token="<s>", eos_token="</s>")
sys.stdout.write(out[3:] if out.startswith("<s>") else out)
PY
  "$kvq" tokenize -m "$model" -f "$tmp/expected.txt" | python3 -c "import json,sys; print(len(json.load(sys.stdin)))"
}

# check_prompt NAME TEMPLATE BODY
check_prompt() {
  local want got
  want=$(expected_tokens "$2" "$3") || { bad "$1: jinja2 failed"; return; }
  got=$(curl -s "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' -d "$3" |
        python3 -c "import json,sys; print(json.load(sys.stdin)['usage']['prompt_tokens'])" 2>/dev/null)
  if [ -n "$got" ] && [ "$got" = "$want" ]; then ok "$1: $got prompt tokens, as jinja2's rendering"
  else bad "$1: prompt_tokens '$got', jinja2's rendering has $want tokens"; fi
}

start_server gguf -m "$tmp/model.gguf"
grep -q "chat template the model's (and its tool_use variant)" "$tmp/gguf.log" && ok "the log names the model's template" ||
  bad "log: $(grep 'chat template' "$tmp/gguf.log")"
chat='{"max_tokens": 2, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hello there  "},
  {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "What is a kernel?"}]}'
check_prompt "gemma-3 template from the GGUF" "$tpl/gemma-3.jinja" "$chat"
tools='{"max_tokens": 2, "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
  "messages": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
  {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
   "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
  {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}'
# the tool_use variant (Llama 3.1) prints arguments with tojson: the server passes them as an object
tools_obj=$(printf '%s' "$tools" | python3 -c "
import json,sys; b=json.load(sys.stdin)
for m in b['messages']:
    for c in m.get('tool_calls') or []: c['function']['arguments'] = json.loads(c['function']['arguments'])
print(json.dumps(b))")
want=$(expected_tokens "$tpl/llama-3.1.jinja" "$tools_obj")
got=$(curl -s "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' -d "$tools" |
      python3 -c "import json,sys; print(json.load(sys.stdin)['usage']['prompt_tokens'])" 2>/dev/null)
[ -n "$got" ] && [ "$got" = "$want" ] && ok "tools: the tool_use template, $got prompt tokens as jinja2's" ||
  bad "tools: prompt_tokens '$got', jinja2's rendering has $want"
# /apply-template renders through the same template: jinja2's text exactly (still in expected.txt)
curl -s "http://127.0.0.1:$port/apply-template" -H 'Content-Type: application/json' -d "$tools" |
  python3 -c "import json,sys; sys.stdout.write(json.load(sys.stdin)['prompt'])" >"$tmp/applied.txt" 2>/dev/null
cmp -s "$tmp/applied.txt" "$tmp/expected.txt" && ok "/apply-template with tools: jinja2's text of the tool_use template" ||
  bad "/apply-template: $(head -c 300 "$tmp/applied.txt")"
# the tool-call syntax is read from the tool_use variant (Llama 3.1's JSON calls), not the Gemma text
grep -q "tool calls llama3-json" "$tmp/gguf.log" && ok "tool-call syntax from the tool_use variant" ||
  bad "log: $(grep 'tool calls' "$tmp/gguf.log")"
code=$(curl -s -o "$tmp/refused.json" -w '%{http_code}' "http://127.0.0.1:$port/v1/chat/completions" \
  -H 'Content-Type: application/json' -d '{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}')
[ "$code" = 400 ] && grep -q "Conversation roles must alternate" "$tmp/refused.json" &&
  ok "a conversation the template refuses: 400 with its message" || bad "refused: $code $(cat "$tmp/refused.json")"
stop_server

start_server file -m "$model" --chat-template "$tpl/qwen3.jinja"
check_prompt "--chat-template FILE (qwen3)" "$tpl/qwen3.jinja" "$chat"
check_prompt "chat_template_kwargs (qwen3, enable_thinking false)" "$tpl/qwen3.jinja" \
  '{"max_tokens": 2, "chat_template_kwargs": {"enable_thinking": false}, "messages": [{"role": "user", "content": "Hi"}]}'

stop_server

printf '{%% if x %%}never closed' >"$tmp/bad.jinja"
"$kvq" serve -m "$model" --port 0 --chat-template "$tmp/bad.jinja" >"$tmp/bad.log" 2>&1 && bad "bad template accepted" ||
  { grep -q "missing {% endif %}" "$tmp/bad.log" && ok "a template that does not parse: a clear error at start" ||
    bad "bad template: $(cat "$tmp/bad.log")"; }
"$kvq" serve -m "$model" --port 0 --chat-template nosuchname >"$tmp/name.log" 2>&1 && bad "unknown name accepted" ||
  { grep -q "neither a built-in template" "$tmp/name.log" && ok "an unknown template name: a clear error" ||
    bad "unknown name: $(cat "$tmp/name.log")"; }

echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
