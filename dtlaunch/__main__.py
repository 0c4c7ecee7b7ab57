from dtlaunch.cli import console_main

console_main()
