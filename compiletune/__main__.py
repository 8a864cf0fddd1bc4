from compiletune.interrupt import exit_on_interrupt

exit_on_interrupt()  # before the heavy imports below (see interrupt.py)

from compiletune.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
