from hetmesh.cli import main

main()
