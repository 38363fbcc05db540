# A/B experiment only: the bench's children with compile_accel's precompiled graphs off.
import compile_accel.precompile

compile_accel.precompile.SUPPORTED = False
