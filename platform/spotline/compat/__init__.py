"""The only code touching private names of torch, Ray and DeepSpeed.

One module per library, one function per need, each name looked up when the module is
imported: a version bump that moves one fails there, in one line naming the library,
its version and the pin, rather than deep inside a failure path.

Never here: logic of Spotline's own. A function does what its private name does, no more.
"""
