from epdctl.cli import main

main()
