"""`kvsplice` command line: generate (streaming to the terminal), bench, serve, deploy."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from kvsplice.bench.cli import add_bench_command
from kvsplice.config import EngineConfig
from kvsplice.deploy import add_deploy_command
from kvsplice.errors import KvspliceError
from kvsplice.sampling import SamplingParams
from kvsplice.server.command import add_serve_command


def _generate(args: argparse.Namespace) -> None:
    from kvsplice.engine.engine import Engine

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed_sampling,
    )
    config = EngineConfig.from_args(args)
    engine = Engine(config)
    print(f"[kvsplice: {config.describe_threads()}]", file=sys.stderr, flush=True)
    request_id = engine.add_request(args.prompt, params)
    print(args.prompt, end="", flush=True)
    while engine.has_unfinished():
        for step in engine.step():
            if step.request_id == request_id:
                print(step.new_text, end="", flush=True)
                if step.output is not None:
                    m = step.output.metrics
                    print(
                        f"\n[{m.prompt_tokens} prompt tokens, {m.generated_tokens} generated, "
                        f"ttft {m.ttft_s * 1000:.0f} ms, "
                        f"{m.generated_tokens / m.e2e_s:.1f} tokens/s overall]",
                        file=sys.stderr,
                    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsplice", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser(
        "generate", help="generate a continuation of a prompt, streamed to the terminal"
    )
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed-sampling", type=int, default=None, help="seed of this request's sampling")
    EngineConfig.add_args(gen)
    gen.set_defaults(run=_generate)
    add_bench_command(commands)
    add_serve_command(commands)
    add_deploy_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], None] = args.run
    try:
        run(args)
    except KvspliceError as err:
        # A user's mistake gets one line, not a traceback.
        print(f"kvsplice: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
