"""slimecore.engines."""
