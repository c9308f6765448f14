"""What a reader of a figure sees, as assertions: labels inside the frame, apart from each other and off
the data. Call after ``fig.canvas.draw()``."""

from __future__ import annotations


def text_boxes(ax):
    """(text, display bbox) of the axes' visible texts and annotations, the empty ones left out."""
    return [(t.get_text(), t.get_window_extent()) for t in ax.texts if t.get_visible() and t.get_text().strip()]


def assert_texts_inside_and_apart(ax) -> None:
    frame = ax.get_window_extent()
    boxes = text_boxes(ax)
    for text, box in boxes:
        assert frame.x0 - 1 <= box.x0 and box.x1 <= frame.x1 + 1 and frame.y0 - 1 <= box.y0 and box.y1 <= frame.y1 + 1, \
            f"{text!r} runs past the axes"
    legend = ax.get_legend()
    if legend is not None:
        for text, box in boxes:
            assert not box.overlaps(legend.get_window_extent()), f"the legend covers {text!r}"
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1:]:
            assert not box_a.overlaps(box_b), f"{a!r} overlaps {b!r}"


def assert_text_off_lines(ax, text_part: str, lines) -> None:
    """No data point of ``lines`` lies inside the text containing ``text_part``."""
    (box,) = [b for t, b in text_boxes(ax) if text_part in t]
    for line in lines:
        for x, y in ax.transData.transform(line.get_xydata()):
            assert not box.contains(x, y), f"{text_part!r} sits on a point of {line.get_label()!r}"


def _tick_boxes(axis):
    return [(t.get_text(), t.get_window_extent()) for t in axis.get_ticklabels()
            if t.get_visible() and t.get_text().strip()]


def assert_figure_readable(fig) -> None:
    """Every axes of ``fig`` passes :func:`assert_texts_inside_and_apart`, and no two tick labels of one
    axis overlap (at a large figure scale, long tick labels run into each other first). Draws the figure."""
    fig.canvas.draw()
    for ax in fig.axes:
        if not ax.get_visible() or not ax.axison:
            continue
        assert_texts_inside_and_apart(ax)
        for axis in (ax.xaxis, ax.yaxis):
            boxes = _tick_boxes(axis)
            for i, (a, box_a) in enumerate(boxes):
                for b, box_b in boxes[i + 1:]:
                    assert not box_a.overlaps(box_b), f"tick labels {a!r} and {b!r} overlap ({ax.get_title()!r})"
