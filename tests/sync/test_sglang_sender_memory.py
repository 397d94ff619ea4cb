"""The SGLang tensor sender keeps no bucket once its request is answered (torch's IPC reference count keeps it
for the engine): at most the posted and the queued bucket are referenced by the trainer at any time. No SGLang
needed: the requests are decoded with torch's own unpickler, as SGLang's serializer does."""
import gc
import io
import pickle
import weakref


from ebbtide.integrations import sglang as S
from ebbtide.sync import Plan, Sender
from sync_models import RULES, checkpoint


def test_tensor_sender_drops_each_bucket_once_answered():
    src = checkpoint(3)
    plan = Plan.of(src, rules=RULES, bucket_bytes=150_000)
    assert len(plan.buckets) >= 4
    refs, alive_at_post, got = [], [], {}

    class Tracking(S.SGLangTensorSender):
        def buffer(self, bucket, stream):
            buf = super().buffer(bucket, stream)
            refs.append(weakref.ref(buf))
            return buf

    def post(endpoint, req):
        if endpoint == "update_weights_from_tensor":
            gc.collect()
            alive_at_post.append(sum(r() is not None for r in refs))
            payload = pickle.load(io.BytesIO(req["serialized_named_tensors"][0]))  # what SGLang deserializes
            for m in payload["metadata"]:
                got[m.name] = payload["flattened_tensor"][m.start_idx:m.end_idx].clone()
            del payload  # the engine releases its tensors before it answers
        return {"success": True, "message": ""}

    sender = Sender(src, Tracking(post), plan=plan)
    for version in (1, 2):
        refs.clear()
        alive_at_post.clear()
        sender.push(version)
        gc.collect()
        assert len(refs) == len(plan.buckets)
        assert max(alive_at_post) <= 2, alive_at_post  # the bucket posted and the one queued behind it
        assert all(r() is None for r in refs)  # nothing kept after the update
    assert set(got) == {o.name for b in plan.buckets for o in b.outputs}
