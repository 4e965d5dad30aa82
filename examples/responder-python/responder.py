"""A downstream service answering hipq from Python with confluent-kafka.

It reads requests from one topic and answers each on another, copying the
hipq-* headers so hipq's default matcher finds the job.

    pip install confluent-kafka
    BROKERS=localhost:9092 REQUESTS=invoice.requests REPLIES=invoice.responses python3 responder.py
"""
import json
import os
import signal

from confluent_kafka import Consumer, Producer

brokers = os.environ.get("BROKERS", "localhost:9092")
requests = os.environ.get("REQUESTS", "invoice.requests")
replies = os.environ.get("REPLIES", "invoice.responses")
group = os.environ.get("GROUP", "example-responder-python")

consumer = Consumer({"bootstrap.servers": brokers, "group.id": group, "auto.offset.reset": "earliest"})
producer = Producer({"bootstrap.servers": brokers})
running = True


def stop(*_):
    global running
    running = False


signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)

consumer.subscribe([requests])
print(f"answering {requests} on {replies}", flush=True)
while running:
    msg = consumer.poll(0.5)
    if msg is None or msg.error():
        continue
    headers = [(k, v) for k, v in (msg.headers() or []) if k.startswith("hipq-")]
    try:
        echo = json.loads(msg.value())
    except ValueError:
        echo = msg.value().decode("utf-8", "replace")
    producer.produce(replies, key=msg.key(), value=json.dumps({"status": "succeeded", "echo": echo}), headers=headers)
    producer.poll(0)
producer.flush(10)
consumer.close()
