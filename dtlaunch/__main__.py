from dtlaunch.cli import run

run()
