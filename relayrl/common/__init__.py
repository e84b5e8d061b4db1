"""The ground floor: files written atomically, user-input errors, the device and the dtype this machine runs
well. Imports nothing else of relayrl, so every other package may import it."""
