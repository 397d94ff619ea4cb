"""placeholder"""
class OffloadedAdam:  # replaced below
    pass
