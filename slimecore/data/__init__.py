"""slimecore.data."""
