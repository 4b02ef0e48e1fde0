"""`python main.py run 01`: train the two hand-driven halves; compare with the monolith."""
from course.demos import print_losses
from course.impl import load, reference


def demo(args):
    m01 = load("m01_manual_split")
    print("Training the model as two hand-driven parts:")
    _, losses = m01.train()
    _, expected = reference("m00_monolith").train()
    print_losses(losses, expected)
    print(f"Loss curve identical to the monolith's, bit for bit: {losses == expected}")
