"""The cost model: the emulated time, memory, energy and communication of a selection on a device."""
