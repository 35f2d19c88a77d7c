"""``python -m mdiedge`` and the ``mdiedge`` console command: the command line, loaded here so
that a Ctrl-C while it loads is the same one line and status 130 as later."""
import sys


def main() -> None:
    try:
        from .cli import main as run
    except KeyboardInterrupt:
        sys.stderr.write("mdiedge: error: interrupted\n")
        raise SystemExit(130) from None
    run()


if __name__ == "__main__":
    main()
