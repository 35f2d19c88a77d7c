"""``python -m mdiedge`` and the ``mdiedge`` console command. Ctrl-C is held back from here
until the command starts (:mod:`mdiedge.base.interrupts`), so a Ctrl-C while the command line
loads is the same one line and status 130 as later."""


def main() -> None:
    from .base import interrupts

    interrupts.hold()
    from .cli import main as run

    run()


if __name__ == "__main__":
    main()
