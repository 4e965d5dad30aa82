// Request/reply over Kafka with hipq, from Node.js with kafkajs and no
// extra codec: each job is produced to hipq's intake topic with a reply
// topic of ours (hipq-reply-to, which hipq's events.allowed_reply_to must
// allow) and a correlation id of ours (hipq-correlation-id, which hipq
// copies onto the job's outcome event); the outcome is read back from the
// reply topic and matched by that id.
//
//   npm install && BROKERS=localhost:9092 INTAKE=hipq.jobs REPLY_TO=callers.node \
//     JOB_TYPE=invoice.quote KEYS=q-1,q-2 node caller.js
//
// It prints one JSON line per job, {"key", "outcome", "result", "error"},
// and exits 0 once every job answered (1 after TIMEOUT_MS without).
const { Kafka, logLevel } = require('kafkajs')
const crypto = require('crypto')

const brokers = (process.env.BROKERS || 'localhost:9092').split(',')
const intake = process.env.INTAKE || 'hipq.jobs'
const replyTo = process.env.REPLY_TO || 'callers.node'
const jobType = process.env.JOB_TYPE || 'invoice.quote'
const keys = (process.env.KEYS || 'q-1').split(',')
const timeoutMs = Number(process.env.TIMEOUT_MS || 60000)

const kafka = new Kafka({ clientId: 'caller-node', brokers, logLevel: logLevel.WARN })
// A group of this process alone; it reads the reply topic from where it
// ended before the first job was produced, so every outcome there from
// then on is seen (and those of other callers passed over).
const consumer = kafka.consumer({ groupId: `caller-node-${crypto.randomUUID()}` })
const producer = kafka.producer()
const admin = kafka.admin()

async function main () {
  await Promise.all([consumer.connect(), producer.connect(), admin.connect()])
  const ends = await admin.fetchTopicOffsets(replyTo)
  await admin.disconnect()
  await consumer.subscribe({ topic: replyTo })
  const waiting = new Map() // correlation id -> job key
  let done
  const all = new Promise(resolve => { done = resolve })
  await consumer.run({
    eachMessage: async ({ message }) => {
      const id = message.headers && message.headers['hipq-correlation-id']
      const key = id && waiting.get(id.toString())
      if (!key) return // another caller's, or an outcome sent again
      waiting.delete(id.toString())
      const event = JSON.parse(message.value.toString())
      console.log(JSON.stringify({ key, outcome: event.outcome, result: event.result, error: event.error }))
      if (waiting.size === 0) done()
    }
  })
  for (const { partition, offset } of ends) consumer.seek({ topic: replyTo, partition, offset })
  const messages = keys.map(key => {
    const id = crypto.randomUUID()
    waiting.set(id, key)
    return {
      key,
      value: JSON.stringify({ job_type: jobType, job_key: key, job_data: { key } }),
      headers: { 'hipq-reply-to': replyTo, 'hipq-correlation-id': id }
    }
  })
  await producer.send({ topic: intake, messages })
  const timer = setTimeout(() => { console.error(`no outcome for ${[...waiting.values()]}`); process.exit(1) }, timeoutMs)
  await all
  clearTimeout(timer)
  await consumer.disconnect()
  await producer.disconnect()
}

main().catch(err => { console.error(err); process.exit(1) })
