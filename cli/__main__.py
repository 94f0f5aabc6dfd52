from slimecore_cli.main import cli

cli()
