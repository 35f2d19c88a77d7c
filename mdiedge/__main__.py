"""``python -m mdiedge`` and the ``mdiedge`` console command. Ctrl-C is held back from here
until the command starts (:mod:`mdiedge.base.interrupts`), so a Ctrl-C while the command line
loads is the same one line and status 130 as later. Idle OpenMP threads are told to sleep
before any OpenMP runtime loads (:func:`mdiedge.base.threads.prefer_passive_waits`)."""


def main() -> None:
    from .base import interrupts, threads

    interrupts.hold()
    threads.prefer_passive_waits()
    from .cli import main as run

    run()


if __name__ == "__main__":
    main()
