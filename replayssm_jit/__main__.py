"""`python -m replayssm_jit {demo,aot} ...`"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "replayssm_jit.demo", "aot": "replayssm_jit.jit.aot"}
    if not argv or argv[0] not in commands:
        print(
            "usage: python -m replayssm_jit {demo,aot} [options]   (--help after a command for its options)"
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = __import__(commands[argv[0]], fromlist=["main"])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
