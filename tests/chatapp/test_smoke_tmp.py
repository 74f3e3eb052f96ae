import pytest
from .helpers import ready, send, idle
from pdchat.chatapp.widgets.messages import MessageView

pytestmark = pytest.mark.anyio

async def test_send(make_app):
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        await send(pilot, "hello there")
        await idle(pilot)
        views = list(app.chat.query(MessageView))
        print([(v.role, v.status, v.content, v.metrics) for v in views])
        app.save_screenshot("/tmp/shot.svg")
