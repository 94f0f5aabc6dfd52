"""slimecore.defaults."""
