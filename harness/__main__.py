"""``python -m harness {train,sweep,lab,claims,list,explain,bench,prepare,docs,soak} ...``: the arguments are parsed
first (harness/run/commandline.py, without torch: ``-h``, a mistyped option and a mistyped experiment answer at
once; a mistyped setting after the schema's imports, torch and the objectives), then the command runs
(harness/apps/cli.py, which imports every component; ``explain``, which reads only the schema's names, runs from here
after those imports: harness/run/names.py)."""

import sys

from harness.run.commandline import parse, refused_experiment
from harness.run.errors import interrupted, one_line_for_a_broken_module


def main(argv: list[str] | None = None) -> int:
    """The command of ``argv`` (default: the process's arguments); its exit status."""
    command = None
    try:
        args = parse(argv)  # -h, or a mistake in the arguments: answered here, in one line, before the imports below
        command = args.command
        with one_line_for_a_broken_module():  # an objective's file that does not import: one line
            if (refused := refused_experiment(args)) is not None:  # before the model's and the runs' imports
                return refused
            if command == "explain":  # the schema's names: no model's library
                from harness.run.names import explain_command

                return explain_command(args)
            from harness.apps.cli import main as run
    except KeyboardInterrupt:  # Ctrl-C in the seconds of the imports: the line the command says once it runs
        if (line := interrupted(command)) is not None:
            print(line, file=sys.stderr)
        return 130
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
