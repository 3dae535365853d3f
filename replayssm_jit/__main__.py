"""`python -m replayssm_jit {demo,aot,autotune} ...` and `python -m replayssm_jit --version`"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    if argv is not None and (
        not isinstance(argv, (list, tuple)) or not all(isinstance(a, str) for a in argv)
    ):
        raise TypeError(f"argv: expected a list of str, got {argv!r}")
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "demo": "replayssm_jit.cli.demo",
        "aot": "replayssm_jit.cli.aot",
        "autotune": "replayssm_jit.cli.autotune",
    }
    if argv == ["--version"]:
        from replayssm_jit.core.version import __version__

        print(f"replayssm-jit {__version__}")
        return 0
    if not argv or argv[0] not in commands:
        helped = bool(argv) and argv[0] in ("-h", "--help")
        print(
            "usage: python -m replayssm_jit {demo,aot,autotune} [options] | --version   (--help after a command for its options)",
            file=sys.stdout if helped else sys.stderr,  # (an error's usage goes to stderr)
        )
        if argv and not helped:
            print(
                f"error: expected a command, demo, aot or autotune, got {argv[0]!r}",
                file=sys.stderr,
            )
        return 0 if helped else 2
    module = __import__(commands[argv[0]], fromlist=["main"])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
