"""`python main.py run 00`: train the monolith and print its loss curve."""
from course.demos import print_losses
from course.impl import load


def demo(args):
    m00 = load("m00_monolith")
    print("Training the monolith (one process, the whole model):")
    print_losses(m00.train()[1])
