"""``agentloop-serve``: a checkpoint behind the OpenAI-compatible gateway (and ``/generate``).

``pip install "agentloop-engines[hf,server]"`` is all it needs::

    agentloop-serve CHECKPOINT [--engine hf|vllm|sglang] [--port 8000] [--chat-template NAME|PATH]
    agentloop-serve CHECKPOINT --server-url http://gpu-0:8000 --server-url http://gpu-1:8000

The first form starts the engine plug-in ``--engine`` names (:mod:`agentloop_core.engine_registry`)
in this process; the second routes over engine servers that already run (the router,
:class:`~agentloop_engines.fleet.client.LLMServerClient`, over one
:class:`~agentloop_engines.fleet.http_client.EngineHTTPClient` per URL). Either way the gateway
serves ``/v1`` (chat, Responses, Messages) with per-session token recording, and the engine
server ``/generate``.

The trainer's ``agentloop serve`` is this command with the engine built from a training config
(``actor_rollout_ref.rollout.*`` overrides): it takes the same options (:func:`add_serve_options`)
and ends in the same :func:`serve_engine`.

This module sits beside the three rooms, not in one: it composes an adapter (through the plug-in
registry), the fleet's router and the serving room's apps, and none of them imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentloop_core.console import console_safe, install_console_logging
from agentloop_core.engine_registry import EngineConfig, build_engine, engine_names
from agentloop_core.parsers.registry import DEFAULT_TOOL_PARSER
from agentloop_engines.fleet.client import LLMServerClient
from agentloop_engines.fleet.http_client import EngineHTTPClient
from agentloop_engines.serving.common import ServerLimits
from agentloop_engines.serving.gateway import Gateway, PromptLimits
from agentloop_engines.serving.gateway.prompt_limits import DEFAULT_TEMPLATE_VARIABLES

__all__ = ["ServeKeys", "add_serve_options", "build_parser", "main", "read_serve_keys", "serve_engine"]


@dataclass(frozen=True)
class ServeKeys:
    """The keys a served engine checks, read from the environment variables the options name."""

    api_key: str | None
    """Bearer token chat clients send (``--api-key-env``); None: no auth."""
    control_key: str | None
    """Key of the control and session routes (``--control-key-env``); None: those routes are off."""


def add_serve_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options every way of serving takes (``agentloop-serve`` and the trainer's
    ``agentloop serve``): address, keys, limits and the chat template. Returns ``parser``."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key-env", default=None,
                        help="name of an environment variable holding the bearer token clients must send")
    parser.add_argument("--control-key-env", default=None, metavar="VAR",
                        help="name of an environment variable holding the control key: what /update_weights, "
                             "/sleep, /wake_up, /abort and the session routes need (a trainer sets "
                             "rollout.server_control_key_env=VAR); default: those routes are off (403)")
    parser.add_argument("--model-name", default=None, help="the model name /v1/models reports (default: the path)")
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="requests served at once; more get 503 with Retry-After (default: 1024)")
    parser.add_argument("--body-timeout-s", type=float, default=None,
                        help="seconds a client has to send its request body; slower gets 408 (default: 30)")
    parser.add_argument("--write-timeout-s", type=float, default=None,
                        help="seconds a client may leave its answer unread; then its connection is aborted and "
                             "its slot freed (default: 30)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="longest prompt after rendering; longer gets 413 (default: 262144)")
    parser.add_argument("--chat-template", default=None, metavar="NAME|PATH",
                        help="chat template to render with instead of the checkpoint's: a built-in "
                             "(chatml-hermes, gemma-hermes, llama3-json) or a Jinja file; needed for tools= when the "
                             "checkpoint's template ignores them")
    parser.add_argument("--template-variable", action="append", default=[], metavar="NAME",
                        help="also let requests set this chat template variable in chat_template_kwargs "
                             "(repeatable; always allowed: enable_thinking, reasoning_effort, thinking)")
    return parser


def read_serve_keys(args: argparse.Namespace) -> ServeKeys:
    """The chat and control keys from the variables ``--api-key-env`` / ``--control-key-env`` name.

    Raises:
        SystemExit: a named variable is unset or empty, or both hold the same key.
    """
    api_key = _key_from_env("--api-key-env", args.api_key_env)
    control_key = _key_from_env("--control-key-env", args.control_key_env)
    if control_key is not None and control_key == api_key:
        raise SystemExit(f"--control-key-env={args.control_key_env} holds the same key as --api-key-env, which "
                         "every chat client holds; give the control key a value of its own")
    return ServeKeys(api_key, control_key)


def _key_from_env(option: str, variable: str | None) -> str | None:
    if not variable:
        return None
    key = os.environ.get(variable)
    if not key:  # the variable's name only: its value is a secret
        raise SystemExit(f"{option}={variable}: that environment variable is not set")
    return key


def serve_engine(engine: Any, tokenizer: Any, args: argparse.Namespace, keys: ServeKeys, *, label: str,
                 tool_parser: str = DEFAULT_TOOL_PARSER, reasoning_parser: str | None = None) -> int:
    """Serve ``engine`` (an engine, or the router over replicas) until stopped: the gateway on
    ``/v1`` and the engine server's ``/generate``, with the limits ``args`` (the options of
    :func:`add_serve_options`) set.

    Args:
        engine: What generates: an ``AsyncServer``.
        tokenizer: The tokenizer the gateway renders with (its chat template already chosen).
        args: The parsed options.
        keys: From :func:`read_serve_keys`.
        label: What is served, for the start-up line (the checkpoint and the engine's name).
        tool_parser: The tool-call parser the gateway reads calls with.
        reasoning_parser: The reasoning parser, or None.
    """
    from agentloop_engines.serving.server import serve  # needs the [server] extra; it says so

    given = {"max_in_flight": args.max_in_flight, "body_timeout_s": args.body_timeout_s,
             "write_timeout_s": args.write_timeout_s}
    limits = ServerLimits(**{k: v for k, v in given.items() if v is not None})
    prompt_limits = PromptLimits(
        template_variables=tuple(dict.fromkeys([*DEFAULT_TEMPLATE_VARIABLES, *args.template_variable])),
        **({} if args.max_prompt_tokens is None else {"max_prompt_tokens": args.max_prompt_tokens}))
    gateway = Gateway(engine, tokenizer, tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                      model_name=args.model_name, prompt_limits=prompt_limits)
    print(f"serving {label} at http://{args.host}:{args.port}/v1 (token-level: /generate)", flush=True)
    # The key itself is never printed: only where it lives.
    if keys.control_key is None:
        print("control routes (/update_weights, /sleep, /wake_up, /abort and the session routes /sessions/...) are "
              "off: start with --control-key-env VAR to push weights to this server or open sessions", flush=True)
    else:
        print(f"control routes need 'Authorization: Bearer <the key in ${args.control_key_env}>'; a trainer pushing "
              f"weights here sets actor_rollout_ref.rollout.server_control_key_env={args.control_key_env}; "
              "POST /sessions/<id> returns a session's base URL", flush=True)
    serve(engine, args.host, args.port, keys.api_key, gateway=gateway, limits=limits, prompt_limits=prompt_limits,
          control_key=keys.control_key)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``agentloop-serve`` command line."""
    parser = argparse.ArgumentParser(
        prog="agentloop-serve",
        description="Serve a checkpoint behind an OpenAI-compatible API with per-session token recording "
                    "(and /generate).")
    parser.add_argument("checkpoint", nargs="?",
                        help="Hugging Face checkpoint folder (with --server-url: the one those servers run; its "
                             "tokenizer renders)")
    parser.add_argument("--engine", default="hf",
                        help="the engine plug-in to start (default: hf; installed: agentloop-serve --list-engines)")
    parser.add_argument("--list-engines", action="store_true", help="print the installed engine plug-ins and exit")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="an argument of the engine's constructor (repeatable); VALUE is read as JSON "
                             "when it parses, else as text: --engine-arg max_batch_size=32")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the checkpoint's)")
    parser.add_argument("--device", default="cpu", help="device of an engine that runs where it is told (hf)")
    parser.add_argument("--dtype", default=None, help="dtype to run in (default: the engine's own)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the engine's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tool-parser", default=DEFAULT_TOOL_PARSER,
                        help=f"the tool-call parser the gateway reads calls with (default: {DEFAULT_TOOL_PARSER})")
    parser.add_argument("--reasoning-parser", default=None, help="the reasoning parser (default: none)")
    parser.add_argument("--server-url", action="append", default=[], metavar="URL",
                        help="route over this running agentloop engine server instead of starting an engine "
                             "(repeatable: least in-flight, sticky per session)")
    parser.add_argument("--server-api-key-env", default=None, metavar="VAR",
                        help="with --server-url: variable holding the engine servers' chat key")
    parser.add_argument("--server-control-key-env", default=None, metavar="VAR",
                        help="with --server-url: variable holding the engine servers' control key")
    return add_serve_options(parser)


def engine_arguments(pairs: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as constructor arguments (VALUE as JSON when it parses).

    Raises:
        SystemExit: a pair without ``=``.
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg {pair!r}: expected KEY=VALUE, e.g. --engine-arg max_batch_size=32")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _load_tokenizer(path: str, chat_template: str | None) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ImportError('agentloop-serve loads the tokenizer with transformers: '
                          'pip install "agentloop-engines[hf]"') from exc
    from agentloop_core.tokenization import set_chat_template

    return set_chat_template(AutoTokenizer.from_pretrained(path), chat_template)


def _engine(args: argparse.Namespace, tokenizer: Any) -> tuple[Any, str]:
    if args.server_url:
        upstream = ServeKeys(_key_from_env("--server-api-key-env", args.server_api_key_env),
                             _key_from_env("--server-control-key-env", args.server_control_key_env))
        router = LLMServerClient([EngineHTTPClient(url, api_key=upstream.api_key, control_key=upstream.control_key)
                                  for url in args.server_url])
        return router, f"{args.checkpoint} ({len(args.server_url)} replicas)"
    config = EngineConfig(name=args.engine, model_path=args.checkpoint, tokenizer_path=args.tokenizer,
                          device=args.device, seed=args.seed, dtype=args.dtype, max_model_len=args.max_model_len,
                          engine_kwargs=engine_arguments(args.engine_arg), chat_template=args.chat_template)
    return build_engine(config, tokenizer=tokenizer), f"{args.checkpoint} ({args.engine})"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``agentloop-serve`` console script."""
    install_console_logging()  # warnings that quote model or tool text are escaped on the console
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_engines:
        print("\n".join(engine_names()))
        return 0
    if args.checkpoint is None:
        parser.error("the checkpoint folder is required: agentloop-serve CHECKPOINT [options]")
    keys = read_serve_keys(args)
    folder = args.tokenizer or args.checkpoint
    if not os.path.isdir(folder):  # else transformers reads it as a hub id, and this machine may be offline
        print(f"agentloop-serve: {folder} is not a folder; pass a Hugging Face checkpoint folder (and --tokenizer "
              "DIR when its tokenizer lives elsewhere)", file=sys.stderr)
        return 2
    try:
        tokenizer = _load_tokenizer(folder, args.chat_template)
        engine, label = _engine(args, tokenizer)
    except (ValueError, LookupError, OSError, ImportError) as exc:  # a wrong name, path, value or extra
        print(f"agentloop-serve: {console_safe(exc)}", file=sys.stderr)
        return 2
    return serve_engine(engine, tokenizer, args, keys, label=label, tool_parser=args.tool_parser,
                        reasoning_parser=args.reasoning_parser)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
