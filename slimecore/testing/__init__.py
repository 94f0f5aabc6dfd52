"""slimecore.testing."""
