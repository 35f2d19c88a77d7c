"""``python -m mdiedge`` and the ``mdiedge`` console command. Ctrl-C is held back from here until
the command starts (:mod:`mdiedge.base.interrupts`), so a Ctrl-C while the command line loads is the
same one line and status 130 as later. Idle OpenMP threads are told to sleep before any OpenMP
runtime loads (:func:`mdiedge.base.threads.choose_openmp_waits`), numpy's OpenBLAS starts no
threads (:func:`mdiedge.base.threads.choose_blas_threads`), and the C heap is one arena
before any thread starts (:func:`mdiedge.base.memory.one_malloc_arena`). A command that ends (with
any status) leaves without the interpreter's teardown (:mod:`mdiedge.base.leave`)."""


def main() -> None:
    from .base import interrupts, memory, threads

    interrupts.hold()
    threads.choose_openmp_waits()
    threads.choose_blas_threads()
    memory.one_malloc_arena()
    from .base.leave import leave
    from .cli import main as run

    try:
        run()
    except SystemExit as e:
        leave(e.code)
    leave(0)


if __name__ == "__main__":
    main()
