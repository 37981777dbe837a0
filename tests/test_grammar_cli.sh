#!/usr/bin/env bash
# kvq generate --json-schema / --json-schema-file: the output (which ends by the
# grammar) validates with Python's jsonschema; bad schemas get one clear error line.
set -u
. "$(dirname "$0")/cli_lib.sh"
model=$shared/models/tinydoc-f16.gguf
need_asset "$model"
python3 -c 'import jsonschema' 2>/dev/null || { echo "SKIP: python3-jsonschema is not installed"; exit 77; }

cat >"$tmp/item.json" <<'JSON'
{"type": "object", "additionalProperties": false, "required": ["id", "name", "tags"],
 "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
                "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 2},
                "ok": {"type": "boolean"}}}
JSON
for seed in 1 2 3; do
  if "$kvq" generate -m "$model" -t 2 -p "The record, as JSON:" -n 300 --seed "$seed" --json-schema-file "$tmp/item.json" \
      >"$tmp/out" 2>"$tmp/err" &&
     python3 -c 'import json, sys, jsonschema; jsonschema.validate(json.load(open(sys.argv[2])), json.load(open(sys.argv[1])))' \
      "$tmp/item.json" "$tmp/out"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1)); echo "FAIL: seed $seed: $(cat "$tmp/out" "$tmp/err")"
  fi
done
"$kvq" generate -m "$model" -t 2 -p "Answer:" -n 50 --seed 4 --json-schema '{"enum": ["yes", "no"]}' >"$tmp/out" 2>/dev/null
python3 -c 'import json, sys; sys.exit(json.load(open(sys.argv[1])) not in ("yes", "no"))' "$tmp/out" &&
  ok "an enum gives one of its values" || bad "enum: $(cat "$tmp/out")"
expect_error "an unsupported keyword is named" "'pattern' is not supported" -- "$kvq" generate -m "$model" -p x --json-schema '{"type":"string","pattern":"a"}'
expect_error "a schema that is not JSON" "invalid JSON" -- "$kvq" generate -m "$model" -p x --json-schema '{"type":'
expect_error "a missing schema file" "cannot open" -- "$kvq" generate -m "$model" -p x --json-schema-file "$tmp/none.json"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
