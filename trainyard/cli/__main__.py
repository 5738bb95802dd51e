from trainyard.cli import main

main()
