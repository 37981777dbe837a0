#!/usr/bin/env python3
"""Renders the chat-template fixtures and snippets with Python's jinja2, set up as
transformers sets it up for apply_chat_template (trim_blocks, lstrip_blocks, the
loopcontrols extension, an immutable sandbox, tojson as json.dumps with
ensure_ascii=False, raise_exception, strftime_now), and prints the cases with their
expected output or error as JSON for tests/test_jinja.c to replay.

Exit status 77 when jinja2 is missing (Debian: python3-jinja2)."""
import json
import os
import sys
from datetime import datetime

try:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:
    print("python3-jinja2 is not installed")
    sys.exit(77)

# strftime_now's clock in the tests; test_jinja.c renders with the same instant (UTC)
NOW = datetime(2026, 3, 5, 14, 7, 9)

TOKENS = {  # bos_token, eos_token as each model's tokenizer_config.json has them
    "llama-3.1": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama-3.2": ("<|begin_of_text|>", "<|eot_id|>"),
    "qwen2.5": (None, "<|im_end|>"),
    "qwen3": (None, "<|im_end|>"),
    "mistral-v3": ("<s>", "</s>"),
    "mistral-nemo": ("<s>", "</s>"),
    "gemma-3": ("<bos>", "<eos>"),
    "phi-3": ("<s>", "<|endoftext|>"),
    "phi-4": ("<|endoftext|>", "<|im_end|>"),
    "phi-4-mini": ("<|endoftext|>", "<|endoftext|>"),
    "mistral-small-3.1": ("<s>", "</s>"),
    "command-r7b-tool_use": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "glm-4.6": (None, "<|endoftext|>"),
    "deepseek-r1-distill": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
}


class Raised(Exception):
    pass


def raise_exception(message):
    raise Raised(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def environment():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: NOW.strftime(fmt)
    return env


def render(env, source, variables):
    try:
        return {"output": env.from_string(source).render(**variables)}
    except Raised as e:
        return {"error": str(e), "raised": True}
    except Exception as e:  # a template error: the C side must fail too
        return {"error": "%s: %s" % (type(e).__name__, e), "raised": False}


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    env = environment()
    cases = []
    with open(os.path.join(here, "snippets.json"), encoding="utf-8") as f:
        snippets = json.load(f)
    for s in snippets["snippets"]:
        case = {"name": "snippet " + s["name"], "template": s["template"], "vars": snippets["vars"]}
        case.update(render(env, s["template"], snippets["vars"]))
        cases.append(case)
    with open(os.path.join(here, "conversations.json"), encoding="utf-8") as f:
        conversations = json.load(f)["conversations"]
    for name in sorted(TOKENS):
        with open(os.path.join(here, name + ".jinja"), encoding="utf-8") as f:
            source = f.read()
        bos, eos = TOKENS[name]
        for conv in conversations:
            for agp in (True, False):
                # what transformers passes: tools and documents always (None when absent)
                variables = dict(conv.get("extra", {}))  # chat_template_kwargs
                variables.update({"messages": conv["messages"], "tools": conv.get("tools"), "documents": None,
                                  "add_generation_prompt": agp, "eos_token": eos})
                if bos is not None:
                    variables["bos_token"] = bos
                case = {"name": "%s / %s / add_generation_prompt=%s" % (name, conv["name"], agp),
                        "file": name + ".jinja", "vars": variables}
                case.update(render(env, source, variables))
                cases.append(case)
    json.dump({"cases": cases}, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
