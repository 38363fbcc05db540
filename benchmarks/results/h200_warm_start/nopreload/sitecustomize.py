# Session 24: the bench's child without the inductor preload (its thread starts and does nothing).
import compile_accel.preload

compile_accel.preload._preload = lambda: None
