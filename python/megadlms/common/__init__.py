"""The bottom layer: what every other layer may import (config errors, mode enums, DTensor helpers)."""
