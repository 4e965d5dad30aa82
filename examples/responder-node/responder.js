// A downstream service answering hipq from Node.js with kafkajs and no
// extra codec: it reads requests from one topic and answers each on
// another, copying the hipq-* headers so hipq's default matcher finds the
// job.
//
//   npm install && BROKERS=localhost:9092 REQUESTS=invoice.requests REPLIES=invoice.responses node responder.js
const { Kafka, logLevel } = require('kafkajs')

const brokers = (process.env.BROKERS || 'localhost:9092').split(',')
const requests = process.env.REQUESTS || 'invoice.requests'
const replies = process.env.REPLIES || 'invoice.responses'
const group = process.env.GROUP || 'example-responder-node'

const kafka = new Kafka({ clientId: 'responder-node', brokers, logLevel: logLevel.WARN })
const consumer = kafka.consumer({ groupId: group })
const producer = kafka.producer()

async function main () {
  await Promise.all([consumer.connect(), producer.connect()])
  await consumer.subscribe({ topic: requests, fromBeginning: true })
  console.log(`answering ${requests} on ${replies}`)
  await consumer.run({
    eachMessage: async ({ message }) => {
      const headers = {}
      for (const [k, v] of Object.entries(message.headers || {})) {
        if (k.startsWith('hipq-')) headers[k] = v // Buffers, copied as they came
      }
      let echo = null
      try { echo = JSON.parse(message.value.toString()) } catch (e) { echo = message.value.toString() }
      await producer.send({
        topic: replies,
        messages: [{ key: message.key, value: JSON.stringify({ status: 'succeeded', echo }), headers }]
      })
    }
  })
}

async function stop () {
  await consumer.disconnect().catch(() => {})
  await producer.disconnect().catch(() => {})
  process.exit(0)
}
process.on('SIGTERM', stop)
process.on('SIGINT', stop)
main().catch(err => { console.error(err); process.exit(1) })
